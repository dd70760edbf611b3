; GPU Provider for Windows: a per-user Inno Setup (6.3 or later) installer around the PyInstaller build.
;
; Build (on Windows, from the repository root, after `pyinstaller --noconfirm --clean build.spec`):
;   iscc /DAppVersion=0.2.0 installer\windows\gpu-provider.iss
; Output: dist\gpu-provider-<version>-windows-x86_64-setup.exe (sign it: docs\releasing.md).
;
; Before copying files (and before uninstalling) it stops the running app AND its engines:
; first politely (taskkill without /F, which asks the app's windows to close), then by force
; with taskkill /F /T on the app's process tree, then any process still running from the app's
; data folder (engines it installed, self-updated versions). An engine left running would hold
; the GPU and its port, and the freshly installed app would fail to start its own.

#ifndef AppVersion
  #error Pass the version: iscc /DAppVersion=X.Y.Z installer\windows\gpu-provider.iss
#endif

#define AppName "GPU Provider"
#define AppExe "gpu-provider.exe"
#define DataFolder "gpu-provider"

[Setup]
AppId={{6F0C2E57-3A7B-4C1E-9B8A-2D5E4F1A7C93}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=gpu-provider
VersionInfoVersion={#AppVersion}
; Per user: no administrator rights, installs under %LOCALAPPDATA%\Programs.
PrivilegesRequired=lowest
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0.19041
OutputDir=..\..\dist
OutputBaseFilename=gpu-provider-{#AppVersion}-windows-x86_64-setup
SetupIconFile=..\..\assets\icon.ico
UninstallDisplayIcon={app}\{#AppExe}
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern
; We stop the app and its engines ourselves (PrepareToInstall); the Restart Manager is a backstop.
CloseApplications=yes
RestartApplications=no

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked
Name: "autostart"; Description: "Start {#AppName} when I sign in (in the tray)"; GroupDescription: "Start-up:"; Flags: unchecked
Name: "wslsetup"; Description: "Set up WSL2 now (asks for administrator rights; needed to serve with vLLM)"; GroupDescription: "NVIDIA GPUs:"; Flags: unchecked; Check: NeedsWsl

[Files]
Source: "..\..\dist\gpu-provider\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Registry]
; The same value worker/system/autostart.py writes ("gpu-provider" under HKCU\...\Run), so the app's
; "Start at login" setting and this checkbox agree. The packaged executable hands over to a
; self-updated version at start, so the value never needs to change with updates.
Root: HKCU; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueType: string; ValueName: "gpu-provider"; ValueData: """{app}\{#AppExe}"" --minimized"; Flags: uninsdeletevalue; Tasks: autostart

[Run]
Filename: "{sys}\wsl.exe"; Parameters: "--install"; Verb: "runas"; Flags: shellexec waituntilterminated skipifsilent; StatusMsg: "Setting up WSL2 (a restart may be needed)…"; Tasks: wslsetup
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; Self-updated versions live beside the user's data; the data itself (settings, models) stays.
Type: filesandordirs; Name: "{localappdata}\{#DataFolder}\app"

[Code]
var
  WslPage: TOutputMsgWizardPage;

function RunHidden(const FileName, Params: String): Integer;
var
  ResultCode: Integer;
begin
  if Exec(FileName, Params, '', SW_HIDE, ewWaitUntilTerminated, ResultCode) then
    Result := ResultCode
  else
    Result := -1;
end;

function AppIsRunning(): Boolean;
begin
  { tasklist always exits 0; find exits 0 only when the image name is listed. }
  Result := RunHidden(ExpandConstant('{cmd}'),
    '/C tasklist /NH /FI "IMAGENAME eq {#AppExe}" | find /I "{#AppExe}"') = 0;
end;

procedure StopAppAndEngines();
var
  Waited: Integer;
begin
  if AppIsRunning() then
  begin
    RunHidden(ExpandConstant('{sys}\taskkill.exe'), '/T /IM {#AppExe}');
    Waited := 0;
    while AppIsRunning() and (Waited < 15000) do
    begin
      Sleep(500);
      Waited := Waited + 500;
    end;
    if AppIsRunning() then
      RunHidden(ExpandConstant('{sys}\taskkill.exe'), '/F /T /IM {#AppExe}');
  end;
  { Engines whose app is already gone are no longer in its tree: stop whatever still runs
    from the app's data folder (installed engines, self-updated versions of the app). }
  RunHidden(ExpandConstant('{sys}\WindowsPowerShell\v1.0\powershell.exe'),
    '-NoProfile -NonInteractive -Command "Get-Process | Where-Object { $_.Path -like ''' +
    ExpandConstant('{localappdata}\{#DataFolder}') + '\*'' } | Stop-Process -Force"');
end;

function PrepareToInstall(var NeedsRestart: Boolean): String;
begin
  StopAppAndEngines();
  if AppIsRunning() then
    Result := '{#AppName} is still running and could not be stopped. Quit it from its tray menu, then click Back and Next.'
  else
    Result := '';
end;

function InitializeUninstall(): Boolean;
begin
  StopAppAndEngines();
  Result := True;
end;

function HasNvidiaGpu(): Boolean;
begin
  Result := FileExists(ExpandConstant('{sys}\nvidia-smi.exe'));
end;

function WslIsInstalled(): Boolean;
begin
  Result := FileExists(ExpandConstant('{sys}\wsl.exe')) and
    (RunHidden(ExpandConstant('{sys}\wsl.exe'), '--status') = 0);
end;

function NeedsWsl(): Boolean;
begin
  Result := HasNvidiaGpu() and not WslIsInstalled();
end;

procedure InitializeWizard();
begin
  WslPage := CreateOutputMsgPage(wpSelectTasks,
    'NVIDIA GPUs and WSL2',
    'vLLM, the faster engine for NVIDIA GPUs, runs inside WSL2 on Windows.',
    'This PC has an NVIDIA GPU but WSL2 is not set up. {#AppName} works without it, serving with ' +
    'llama.cpp; with WSL2 it can also serve with vLLM.' + #13#10 + #13#10 +
    'To set it up: tick "Set up WSL2 now" on the previous page, or later open PowerShell as ' +
    'administrator and run:  wsl --install' + #13#10 +
    'Then restart Windows and keep your NVIDIA driver current (it provides CUDA inside WSL2; ' +
    'do not install a Linux NVIDIA driver inside WSL).' + #13#10 + #13#10 +
    'More: https://learn.microsoft.com/windows/wsl/install');
end;

function ShouldSkipPage(PageID: Integer): Boolean;
begin
  Result := (WslPage <> nil) and (PageID = WslPage.ID) and not NeedsWsl();
end;
